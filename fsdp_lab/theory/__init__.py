"""The article as code: its memory and communication formulas, the GPU planner, the NumPy MiniFSDP."""
