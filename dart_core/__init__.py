"""dart-serve's model side (target adapter, DART draft head, verification,
decoding engine), importable without Ray.  So far: the locator of the
target model and its tokenizer, :mod:`dart_core.tokenizer`."""
