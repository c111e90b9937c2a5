import pytest


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """`launches(key)`: what the test module's `start_launch(key, tmp_path_factory, fixture)`
    returns (its ranks' results, and what the checks need besides), started at the first test
    that asks and kept for the module's other tests: the honest cases and the plants of a launch
    share its ranks. `fixture(name)` is another fixture's value (`request.getfixturevalue`)."""
    start, done = request.module.start_launch, {}

    def launch(key):
        if key not in done:
            done[key] = start(key, tmp_path_factory, request.getfixturevalue)
        return done[key]
    return launch
