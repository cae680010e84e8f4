from graphpipe.cli import console_main

console_main()
