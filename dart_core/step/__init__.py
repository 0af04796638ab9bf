"""The step layer: propose → select → verify → accept, batch-first.

The engine (:mod:`.engine`), acceptance (:mod:`.verify`), sampling parameters (:mod:`.sampling`),
structured output (:mod:`.grammar`) and the one-sequence reference step that the engine is
checked against (:mod:`.reference`).  Imports the speculation and model layers, nothing above.
"""
