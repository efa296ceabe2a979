"""The memory planner: plans that fit a step into a memory budget (blocks to checkpoint by a
knapsack, micro-batches, bf16 activations, smaller optimizer states), for the search to race."""
