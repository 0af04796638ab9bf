"""Incremental detokenisation: token ids in, safe-to-show text out, step by step.

A streamed completion must show text as tokens arrive, but a token is not
always text on its own: byte-level BPE splits a multi-byte character over
several tokens (decoded alone, each is U+FFFD), and a stop string can begin
in one step and end in a later one.  :class:`IncrementalDetokenizer` keeps
two offsets into the token list (the approach of vLLM's and Hugging Face
TGI's streaming decoders):

- ``prefix_offset``..``read_offset``: a few tokens already turned into text,
  decoded again as context (tokenizers that drop a leading space at the start
  of a decode give the same text for both decodes);
- ``read_offset``..end: the tokens not yet shown.

Each new token costs two decodes of a window of a few tokens, so a whole
completion costs time linear in its length.  New text is taken only once it
no longer ends in U+FFFD (an incomplete UTF-8 sequence: the next token
completes it); at the end whatever is left is flushed as it decodes.

Stop strings: the text is searched for them as it grows; the first match
ends the completion there (the stop string itself is not shown), and while
running, the last ``max(len(stop)) - 1`` characters are held back, since
they could be the start of a stop string still to come.

Worked example (byte-level BPE, "é" split over two tokens a, b)::

    d = IncrementalDetokenizer(tokenizer, stop=["\\n\\n"])
    d.add([a])        -> ""        (a alone is U+FFFD: held)
    d.add([b, c])     -> "é"       (c = "\\n": held, could start "\\n\\n")
    d.add([c])        -> ""        and d.stopped is True (text "é")
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["IncrementalDetokenizer"]

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is all that is used).
        stop: stop strings (empty ones are ignored).
        skip_special_tokens: as ``tokenizer.decode``.
        include_stop: keep the stop string that ends the text (vLLM's ``include_stop_str_in_output``).

    Attributes:
        text: all text shown or held so far (cut at a stop string once found).
        stopped: a stop string was found; later tokens are ignored.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.shown = 0  # characters of self.text returned so far
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_pending(self, final: bool) -> str:
        """Text of the tokens after read_offset (advancing the offsets), "" while incomplete."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(_INCOMPLETE) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text that may be shown now (possibly "")."""
        if self.stopped:
            return ""
        start = len(self.text)
        for tok in token_ids:
            self.ids.append(int(tok))
            self.text += self._decode_pending(final=False)
        return self._release(start, final=False)

    def finish(self) -> str:
        """Flushes what is held back (an incomplete character decodes as U+FFFD); call once at the end."""
        if self.stopped:
            return ""
        start = len(self.text)
        self.text += self._decode_pending(final=True)
        return self._release(start, final=True)

    def _release(self, start: int, final: bool) -> str:
        if self.stop and len(self.text) > start:
            found = self._find_stop(start)
            if found is not None:
                at, matched = found
                self.text = self.text[:at + (len(matched) if self.include_stop else 0)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(self.shown, len(self.text) - self.hold)
        delta = self.text[self.shown:end]
        self.shown = max(self.shown, end)
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(where the earliest stop string begins, that string), looking only where new text could
        complete one; None when none is there."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best
