"""The solvers: plain data in (blocks, rules, a cost context), plain data out; no torch here.

- space.py        the decision space and the user's constraints resolved onto blocks
- chain_dp.py     exact units + per-unit decisions of one stage (Pareto DP)
- brute_force.py  exhaustive enumeration of the same space: the test oracle
- stages.py       exact min-max pipeline stage cuts
- search.py       the outer enumeration of meshes, micro-batch counts and schedules
- assemble.py     the chosen candidate as a Plan's units, stages, tp section and predicted terms
- explain.py      the plan's reasoning (binding constraint, runner-ups) and why no plan fits
- evaluate.py     a given plan's own decisions priced
"""
