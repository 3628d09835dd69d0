/* An executable that links one of the daemon's lower floors (sd_transport, sd_coll, sd_cluster)
 * whole, with only the libraries that floor may use: it exists so that a call from the floor
 * into the daemon above it fails the build (an undefined symbol), not a review. */
int main(void)
{
    return 0;
}
