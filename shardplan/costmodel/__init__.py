"""The cost model: time and memory of a plan's units, stages and step on a hardware profile."""
