"""The one error type a user sees.

Anything wrong with what the user gave us (a checkpoint, an adapter, a size string, a prompt) is raised
as `Edge0Error` with a one-line message naming the file and the problem. The CLI and the app print
that line; every other exception is a bug in edge0.
"""


class Edge0Error(Exception):
    """A problem with the user's input or environment, explained in one line."""
