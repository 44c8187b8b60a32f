"""What every instance of the app shares, kept in the Function App's storage account (store.py)."""
