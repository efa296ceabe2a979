"""The search: stage by stage, candidates measured against the current best in paired rounds
(``candidate``, ``compare``), alternatives of one lever raced (``fastest_fit``), adoptions
confirmed together (``confirm``), every verdict by the rules of one module (``decide``), within
a time budget (``budget``), and ``run``, the tuner itself. It stands on the batch finder, the
memory planner and the loader grid (whose stage is ``loader_stage``), and writes nothing: the
report reads its outcome."""
