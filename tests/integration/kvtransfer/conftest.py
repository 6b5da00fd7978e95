"""`leave_out`: a test of a fixture-parametrized module that needs only some of the combinations
(test_network_transfer.py: a test of what both network backends share runs on tcp alone).

`@pytest.mark.leave_out(backend="ucx", exporter="shared-memory")` deselects the test's instances
whose parameters take all of those values; several marks leave out each their own. Deselected, not
parametrized over a shorter list: the module-scoped fixtures keep one order of their parameters,
so pytest still starts each exporter process once for every test that uses it."""


def pytest_configure(config):
    config.addinivalue_line("markers", "leave_out(**params): deselect this test's instances whose "
                                       "parameters take all of these values (tests/integration/kvtransfer)")


def pytest_collection_modifyitems(config, items):
    def is_left_out(item) -> bool:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        return any(all(k in params and params[k] == v for k, v in mark.kwargs.items())
                   for mark in item.iter_markers("leave_out"))

    left_out = [item for item in items if is_left_out(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not is_left_out(item)]
