/* egress.c: the network allow-list's part of --confine: the way to the harness's egress proxy. */
#ifndef DSH_EGRESS_H
#define DSH_EGRESS_H

/* The proxy --proxy NAME names, reached from the harness's network: @NAME, an abstract socket, is
 * connected to (the descriptor is returned); PATH, a socket file, is only looked at (-1). */
int connect_proxy(const char *name);
/* Takes the proxy's key out of the environment variable NAME (--proxy-key-env). */
void take_proxy_key(const char *name);
/* Forks the forwarder on 127.0.0.1 of the command's network (port 3128, or where that is taken in a
 * network OWN_NETWORK 0 says is shared, another); returns its port. Each connection goes over CONTROL
 * (SCM_RIGHTS), or (CONTROL -1) through a relay of its own to the socket file PATH, after the key. In
 * a shared network only a connection from a process of this command's is served. */
int start_forwarder(int control, const char *path, int own_network);
/* HTTP_PROXY and its kin, naming the forwarder's PORT. */
void set_proxy_variables(int port);

#endif
