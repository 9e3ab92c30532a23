"""The benches: each is a module run from the repository root as `python -m bench.<name>` (`--help` says what it
measures and how); the modules without a `main` are the pieces they share."""
