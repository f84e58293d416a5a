"""Internal time bounds, in one place. The ones a user may need to tune are fields of `NetworkConfig` instead.

Every wait in p2p-diloco is bounded: by a config field (documented in `p2p_diloco.config`, overridable from the
command line) or by one of these margins, which only keep a bounded wait from racing the bound it depends on.
"""

DHT_STOP_S = 5.0
"""A DHT process gets this long to stop cleanly before it is killed."""
BOOTSTRAP_TIMEOUT_S = 3.0
"""hivemind's wait for the initial peers' first replies, kept: a first dial through a relay takes round trips."""
AVERAGER_COMMAND_S = 30.0
"""A command sent to the averager process (such as switching the matchmaking schema) answers within this."""
RESULT_MARGIN_S = 30.0
"""The host waits for a round's result `allreduce_timeout` plus this (the averager's own bounds fire first)."""
STATE_MARGIN_S = 5.0
"""The host waits for a state download `state_timeout` plus this (the averager's own bound fires first)."""
SEARCH_MARGIN_S = 0.5
"""With quorum 1, an island looks for a group for its grace window plus this, then merges alone."""
STEP_MARGIN_S = 1.0
"""An averaging step is given at least its grace window plus this, so it can assemble the group it waited for."""
STAGE_POLL_S = 0.005
"""How often the host reads the averaging stage, which lives in shared memory with no event to wait on."""
SOCKET_STATS_S = 10.0
"""Bound on one run of `ss` when counting the daemon's TCP bytes."""
LINGER_S = 1.0
"""After its last merge an island waits this long before stopping its daemons: p2pd tells nobody when the replies
it still holds for partners have left the host, and a partner that misses them discards the round."""
CHILD_STOP_S = 15.0
"""A launcher gives a child this long to stop after SIGTERM before it kills the child's whole session."""
