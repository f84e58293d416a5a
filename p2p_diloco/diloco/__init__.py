"""DiLoCo's math in pure torch: outer optimizer, pseudo-gradients, merge rules, staleness, fragments, grace window."""
