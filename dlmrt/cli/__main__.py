from dlmrt.cli.commands import run

run()
