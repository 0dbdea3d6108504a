from nodemgr.cli import main

main()
