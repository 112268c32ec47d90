"""Virtual-time swarm: many peers' real protocol cores in one process over one in-memory network."""
