from reshard.cli import entry

entry()
