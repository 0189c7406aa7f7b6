"""The torchrun workers: ``python -m swiftspec.engine.worker``, one process per rank.

Ranks 0..x-1 are the target group (tensor parallel over x), ranks x..world-1 the draft group (none with
``--draft none``: ``ar`` only). Target rank 0 is the leader: it talks to the Engine over the authenticated
socket, decides when an answer stops, and starts every request on every rank. Inside each group the group
leader tells its TP followers which step comes next, so all ranks of a group make the same calls in the
same order. Between the groups only small messages travel, leader to leader (engine/spec/loop.py).

``setup`` places a rank and loads its models, ``wire`` packs the messages, ``leader_io`` is the leader's
socket, ``serve`` runs the requests.
"""
