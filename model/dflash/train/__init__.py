"""Training a DFlash2 drafter on the target's own greedy outputs (`twinspark train-drafter`): the traces, the block
objective and the loop. The command itself is the drafter service's (services/drafter/train_cli.py): the library
imports nothing above it."""
