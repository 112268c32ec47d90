"""What tests share, defined once: the in-memory network and the helpers every kind of test needs.

Test files import from here and never from each other. ``memnet.MemNet`` is the network for trio code (the link
model of ``peerd/tools/sim/net.py``, the one `peerd sim` runs on, under trio's clock); ``virtual`` runs a test in
virtual time and reads counters; ``processes`` starts the real CLI; the other modules hold one area's fixtures
(a swarm of DHT nodes, a group of averaging cores, a trainer's in-process daemon, ...)."""
