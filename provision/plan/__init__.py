"""Plan / apply: an ordered list of steps computed from facts and options; each knows if it is already done."""
