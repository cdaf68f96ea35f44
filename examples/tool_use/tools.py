"""The tool of examples/tool_use: the model multiplies 3-digit numbers by calling it (README: "Tools")."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
