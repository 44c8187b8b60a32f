"""What every instance of the app shares, kept in the Function App's storage account (store.py),
built at start-up by shared.py; the request path talks to it through port.py's values."""
