"""The front end: a model and its example inputs → a torch.fx graph → annotated by passes → a BlockChain."""
