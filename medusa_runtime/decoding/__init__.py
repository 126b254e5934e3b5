"""Decoding: ``decode.py`` (the Medusa decode loop: propose, verify the tree in one forward, accept, commit;
plain decoding as its degenerate case), ``drafter.py`` (the heads' candidates from a step's hidden state),
``acceptance.py`` (greedy, typical and exact-sampling acceptance), ``guided.py`` (decoding constrained to a set of
strings), ``lockstep.py`` (several runs stepped in turn), ``batched.py`` (greedy replies to many prompts at once,
continuous batching)."""
