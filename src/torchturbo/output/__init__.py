"""What torchturbo shows and writes for a person: terminal output and result files.

``live`` draws the progress lines of long commands, ``tables`` prints the bench rows (not the
tuner's report, :mod:`torchturbo.tune.report.write`), ``table_fit`` fits a table to the terminal's
width, ``units`` reads and writes durations, sizes and switches, ``suggest`` finds the closest
word for a did-you-mean, and ``results_file`` writes JSON results atomically (through links, or
to stdout for ``-``) with the machine's summary (not a technique's result,
:mod:`torchturbo.techniques.framework.result`).
"""
