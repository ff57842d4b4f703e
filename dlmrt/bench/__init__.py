"""`dlmrt bench`'s machinery: suites, the benchmark models, timing and the regression gate."""
