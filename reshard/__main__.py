from reshard.cli.app import entry

entry()
