"""tandem.router"""
