helper() { :; }
