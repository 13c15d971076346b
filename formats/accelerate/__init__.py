"""accelerate's ``save_state`` folders: ``format`` reads them."""
