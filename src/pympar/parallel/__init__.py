"""Parallel strategies (dp, tp, pp, ep, zero) and the process mesh they share."""
