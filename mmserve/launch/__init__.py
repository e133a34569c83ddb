"""Starting, supervising and stopping the server's processes, from the command line's config."""
