from tests.bad_input.common import no_training  # noqa: F401 (a fixture of every case here)
