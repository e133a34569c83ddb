"""What crosses between the server's processes: the messages, their queues and the socket addresses."""
