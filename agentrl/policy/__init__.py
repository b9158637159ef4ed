"""Policies of the run loop: each a small unit with named constants and its own tests. Storage
(the replay buffer) reports facts; these decide."""
