#!/bin/bash
echo main
