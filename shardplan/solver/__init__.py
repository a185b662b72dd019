"""The solvers: plain data in (blocks, rules, a cost context), plain data out; no torch here.

- space.py        the decision space and the user's constraints resolved onto blocks
- chain_dp.py     exact units + per-unit decisions of one stage (Pareto DP)
- brute_force.py  exhaustive enumeration of the same space: the test oracle
- stages.py       exact min-max pipeline stage cuts
- search.py       the outer enumeration of meshes, micro-batch counts and schedules
"""
