"""Hand-written commentary for REPORT.md: where our numbers differ from the paper's, and why.

Written after reading a full run's results; the numbers themselves always come from the result files.
"""

NOTES: dict[str, str] = {}
