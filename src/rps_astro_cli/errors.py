"""User-facing errors. The CLI layer turns `AstroUserError` into a one-line message and
exit code 2; services turn it into an HTTP 4xx naming the field."""


class AstroUserError(ValueError):
    """A mistake in user input (file, flag, request field).

    Attributes:
        field: the name of the offending field/flag/file, or None.
        fix: a short hint on how to fix it, or None.
    """

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.field = field
        self.fix = fix
        text = message
        if field and field not in message:
            text = f"{field}: {message}"
        if fix:
            text = f"{text} ({fix})"
        super().__init__(text)
