// The function app's app settings, written as one resource on every deployment from the layers that
// resources.bicep describes ("App settings"), the later winning over the earlier: the template's
// defaults, the settings the site has now (so that a value set in the portal is kept), the
// operator's CHAT_APP_SETTINGS, and the settings the template owns. A setting none of them names is
// left as it is.

param appName string

@secure()
@description('The site\'s settings before this deployment. Secure: they may hold a key someone set by hand, and a module\'s parameters are kept in the deployment history.')
param currentAppSettings object

param templateDefaults object
@secure()
@description('CHAT_APP_SETTINGS: secure, as it may hold a key (a pool entry\'s), and a module\'s parameters are kept in the deployment history.')
param operatorSettings object
param templateSettings object

resource site 'Microsoft.Web/sites@2024-11-01' existing = {
  name: appName
}

resource appSettings 'Microsoft.Web/sites/config@2024-11-01' = {
  parent: site
  name: 'appsettings'
  properties: union(templateDefaults, currentAppSettings, operatorSettings, templateSettings)
}
