"""Several ranks in one pool: the process group and rows split across ranks (distributed.py), and the follower ranks'
loop, the leader's broadcasting executor and the engine build every rank runs (rank_loop.py)."""
