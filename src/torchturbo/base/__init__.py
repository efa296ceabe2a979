"""The ground floor: small helpers that import nothing else of torchturbo.

Every other package may use them, so they sit below all of them: walking nested batches
(``nested``), the model's device and the one move of a batch to it (``device``), saved-tensor
hooks that compose (``saved_tensors``), what the NHWC layout applies to (``nhwc``), the
signals that stop a run and what a loader worker does on one (``stop_signals``), and a path
lost in a loop of symbolic links (``paths``).
"""
