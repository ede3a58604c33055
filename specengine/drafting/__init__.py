"""Trained drafting artifacts: the SpecDec++ acceptance head, the ParallelSpec drafter, their
file format, and the ones shipped for the default pair (heads/, drafters/)."""
