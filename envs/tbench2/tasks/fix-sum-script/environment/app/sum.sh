#!/bin/bash
# Prints the sum of two integers.
echo $(( $1 - $2 ))
