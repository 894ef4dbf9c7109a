from hpcshard.cli import main

main()
