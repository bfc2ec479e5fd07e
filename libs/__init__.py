"""libs"""
