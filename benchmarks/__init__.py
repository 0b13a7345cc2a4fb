"""kq's benchmark suite (`python -m benchmarks --help`); not part of the installed package."""
