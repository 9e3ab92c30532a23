"""Training a DFlash2 drafter on the target's own greedy outputs (`twinspark train-drafter`): the traces, the block
objective and the loop."""
