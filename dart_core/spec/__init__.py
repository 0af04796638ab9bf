"""The speculation layer: what drafts and how much is verified.

The DART draft head (:mod:`.draft_head`), the EAGLE-3 head and its dynamic tree (:mod:`.eagle3`),
the drafters behind one interface (:mod:`.drafters`), the adaptive budget and the speculation gate
(:mod:`.budget`) and the speculative configuration (:mod:`.speculative`).  Imports the model layer
and :mod:`ngram_service`, nothing above.
"""
