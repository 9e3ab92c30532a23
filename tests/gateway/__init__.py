"""Gateway tests: unit tests of its pieces, and service tests against a stand-in scheduler."""
