from kq.cli import main

main()
