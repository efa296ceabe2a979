"""The batch finder (``tune --find-batch``): the largest micro-batch whose step fits a memory
budget, measured at a few sizes (``probe``), and what the finder chose (``choice``). Below the
search, which starts from its choice."""
